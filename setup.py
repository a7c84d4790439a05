"""hvd_balance: static and adaptive load balancing for Horovod Keras training on mixed devices."""
import re

from setuptools import find_packages, setup

# The version is written once, in hvd_balance/_version.py.
VERSION = re.search(r'__version__ = "([^"]+)"', open("hvd_balance/_version.py").read()).group(1)

setup(
    name="hvd_balance",
    version=VERSION,
    description="Load balancing for synchronous Horovod Keras training on heterogeneous clusters",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hvd_balance", "hvd_balance.*"]),
    python_requires=">=3.9",
    # TensorFlow and Horovod are installed by scripts/install.sh (Horovod must be compiled
    # against the installed TensorFlow), so they are not pinned here.
    install_requires=["numpy>=1.22", "pyyaml>=5.4"],
    extras_require={"bench": ["matplotlib>=3.5"], "plot": ["matplotlib>=3.5"], "test": ["pytest>=7", "pytest-timeout>=2"],
                    "lightning": ["lightning>=2.1,<3"], "ray": ["ray[train]>=2.9,<3"]},
    entry_points={"console_scripts": ["hvd-balance=hvd_balance.tools.cli:main"]},
)
