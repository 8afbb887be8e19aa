"""depctl's child processes run from any directory, a clone's parent included."""

from __future__ import annotations

import subprocess

from depctl import config


def test_child_processes_do_not_import_a_depctl_folder_in_the_current_directory(tmp_path):
    # the bug: `depctl serve` from the folder that holds a clone died with "cannot import name '__version__' from
    # 'depctl'": `python -m` put the current directory first on the path, and its depctl/ shadowed the installed one
    (tmp_path / "depctl").mkdir()
    (tmp_path / "depctl" / "__init__.py").write_text("raise SystemExit('the wrong depctl was imported')\n")
    (tmp_path / "depctl_runtime").mkdir()
    (tmp_path / "depctl_runtime" / "__init__.py").write_text("raise SystemExit('the wrong runtime was imported')\n")
    for module in ("depctl_runtime", "depctl_runtime.training"):
        run = subprocess.run(config.python_module(module) + ["--help"], cwd=tmp_path, capture_output=True, text=True)
        assert run.returncode == 0, (module, run.stderr[-2000:])
