"""Reproducing the paper and seeing the memory: the launchers' planner, the results collector,
the memory plots (paper Figures 5, 6, 8-9).

    experiments.py  the paper's runs and numbers          topology.py  ranks, hostfiles, batch split
    footprint.py    GPU memory per rank                    cost.py      steps and GPU-hours
    plan.py         the planner CLI (launch/repro/*.sh)    standins.py  stand-in data for smoke runs
    collect.py      run directories -> tables              trace.py     evaluation-time memory trace
    memory_data.py  figure data from a memory state        plots.py     the PNGs
    analyze.py      the analysis CLI (launch/analyze.py)

Submodules are imported on use (plotting needs matplotlib; planning needs no GPU).
"""
