"""mrv2's Hydra config tree, installed as the package `mrv2_conf` so that it works from a wheel too."""
