from depctl.cli import main

main()
