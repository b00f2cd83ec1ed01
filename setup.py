"""Package layout: the four import packages, plus the Hydra tree `conf/` shipped as `mrv2_conf`."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["framework*", "model_states*", "speculators*", "samplers*"]) + ["mrv2_conf"],
    package_dir={"mrv2_conf": "conf"},
)
