"""Many runs of one protocol, and their reports.

A sweep (`sweep`, `sweep_lib`: a grid of tasks, lengths, mixers, seeds and
learning rates, resumable by several processes through `run_lock`), an
ablation (`ablate`: mixers of one config), and what is read back from the
finished runs (`sweep_report`, `recall`). Built on `experiments.training`.
"""
