import sys

from depctl_runtime.training.eagle import main

sys.exit(main())
