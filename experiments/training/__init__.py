"""One training run: the model, its program, the loop and its bookkeeping.

`train.train_and_evaluate` trains one config in one workdir (checkpoints,
metrics, the summary); `model` and `program` build what it runs. Imports
`experiments.tasks` and the library, nothing else of experiments/.
"""
