"""Every memory kind on one recipe, against the plain model of the same seed, with its price.

`python -m memoria_ds.compare` (see `__main__.py`): `recipes.py` (what a comparison holds fixed,
the refusal of mixed recipes), `store.py` (one result file per run, the transcribed results of
the docs), `runner.py` (runs what is missing through the benchmark scripts), `table.py` and
`figure.py` (the table and the quality-against-price figure).
"""
