"""Which of depctl's dependencies a bare CUDA image lacks, pinned to the versions installed here.

``scripts/gpu_check.sh --prepare`` downloads these as CPython 3.12 manylinux wheels for the GPU machine. The walk
follows depctl's requirements (and their requirements) as they apply on Linux under Python 3.12, and stops at what
the image ships, whose own versions are kept there (torch and transformers above all).
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys

from packaging.requirements import Requirement

# the GPU image's packages, as its pip list names them (what the GPU machine to plan for has)
IMAGE = frozenset(
    """
    accelerate annotated-doc anyio attrs certifi charset-normalizer click cloudpickle cmake einops filelock fsspec h11
    hf-xet httpcore httpx huggingface-hub hypothesis idna iniconfig jinja2 markdown-it-py markupsafe mdurl mpmath
    networkx ninja numpy nvidia-ml-py packaging pillow pip pluggy prometheus-client protobuf psutil pygments pytest
    pytest-timeout pytest-xdist pyyaml regex requests rich safetensors sentencepiece setuptools shellingham six
    sympy tabulate tiktoken tokenizers torch tqdm transformers triton typer typing-extensions urllib3 uvloop wheel
    """.split()
)
LINUX_312 = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux"}
LINUX_312 |= {"platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def needed(root: str = "depctl") -> dict[str, str]:
    """{name: installed version} for every requirement of ``root``, transitively, that the image does not ship."""
    found: dict[str, str] = {}
    stack = [root]
    while stack:
        dist = metadata.distribution(stack.pop())
        for line in dist.requires or []:
            req = Requirement(line)
            name = canonical(req.name)
            if (req.marker and not req.marker.evaluate(LINUX_312)) or name in IMAGE or name in found:
                continue
            found[name] = metadata.version(name)
            stack.append(name)
    return dict(sorted(found.items()))


if __name__ == "__main__":
    print("\n".join(f"{name}=={version}" for name, version in needed(*sys.argv[1:]).items()))
