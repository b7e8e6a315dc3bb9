"""Seeing the memory: the plots of paper Figures 5, 6, 8-9 from a saved memory and its trace.

    memory_data.py  figure data from a memory state       plots.py     the PNGs
    analyze.py      the analysis CLI (launch/analyze.py)

The trace itself is recorded during evaluation (memoria_ds/eval/trace.py). A top floor: nothing
in the package imports it. Submodules are imported on use (plotting needs matplotlib).
"""
