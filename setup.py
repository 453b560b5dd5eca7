"""Package metadata; ``pip install -e .[test]`` sets up development."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
# The version is written once, in megatron_bfpp/__init__.py (read, not imported: setup runs
# before the package's dependencies exist).
VERSION = re.search(
    r'^__version__ = "([^"]+)"$',
    (HERE / "megatron_bfpp" / "__init__.py").read_text(encoding="utf-8"),
    re.MULTILINE,
).group(1)
# pip's form of megatron_bfpp.compat.SUPPORTED_WINDOW and TORCH_WINDOW (tests/unit/test_versions.py
# keeps them equal): megatron-core 0.16 from 0.16.1 on Python 3.10/3.11, 0.17-0.20 on Python
# >= 3.12; torch from 2.13 (a newer torch runs with a warning naming the tested ones).
MEGATRON_CORE = "megatron-core>=0.16.1,<0.21"
TORCH = "torch>=2.13"

setup(
    name="megatron-bfpp",
    version=VERSION,
    description=(
        "Breadth-first, BPipe and V-shape pipeline schedules for NVIDIA megatron-core / "
        "Megatron-LM, with a schedule simulator and planner"
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_bfpp", "megatron_bfpp.*"]),
    install_requires=[],
    extras_require={
        # Drawing timelines as PNG.
        "plot": ["matplotlib>=3.7"],
        # bfpp-train --tensorboard-dir / --wandb-project.
        "tensorboard": ["tensorboard>=2.14"],
        "wandb": ["wandb>=0.17"],
        # Running schedules on megatron-core (CPU or GPU). psutil: megatron-core's distributed
        # checkpoint writer (bfpp-train --ckpt-format torch_dist) imports it, megatron-core does
        # not install it.
        "megatron": [TORCH, MEGATRON_CORE, "psutil>=5.9"],
        # Development and CI: tests, lint, types.
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "packaging>=23",  # tests/unit/test_versions.py reads pip pins
            "matplotlib>=3.7",
            "ruff==0.17.6",  # pinned: lint results must not change under CI
            "mypy==2.4.1",
            TORCH,
            MEGATRON_CORE,
            "psutil>=5.9",
            "tensorboard>=2.14",
            "wandb>=0.17",
        ],
        # Running Megatron-LM's own pretrain scripts (its runtime dependencies; Megatron-LM
        # itself is a checkout, not a PyPI package).
        "megatron-lm": ["six", "pyyaml", "pydantic", "regex", "pybind11", "triton"],
        # GPU-only speedups megatron-core can use; never needed on CPU.
        "gpu": ["transformer-engine[pytorch]", "apex"],
    },
    entry_points={
        "console_scripts": [
            "bfpp-sim=megatron_bfpp.cli.sim:command",
            "bfpp-train=megatron_bfpp.cli.train:main",
            "bfpp-plan=megatron_bfpp.cli.plan:command",
        ]
    },
)
