"""Reproducing the paper: the launchers' planner and the results collector.

    experiments.py  the paper's runs and numbers          topology.py  ranks, hostfiles, batch split
    footprint.py    GPU memory per rank                    cost.py      steps and GPU-hours
    plan.py         the planner CLI (launch/repro/*.sh)    standins.py  stand-in data for smoke runs
    collect.py      run directories -> tables (launch/collect.py)

The top floor: it reads `train`, `model`, `eval` and `data`; nothing in the package imports it.
Submodules are imported on use (planning needs no GPU).
"""
