"""Planning a run before anything starts: where each process goes (placement), what each GPU holds (memory plan), the model shapes, shared memory and ports it needs.

`python -m recipe_gkd.runtime.check_placement` checks a placement on the cluster itself; `python -m
recipe_gkd.plan.placement --print teacher-gpus` prints the GPUs a launcher gives the teacher server.
"""
