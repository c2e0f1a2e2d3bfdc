"""How a stage runs, once a command has read its options: the layer between the engines and the commands.

``skyrl sft`` and ``skyrl rl`` parse their options into a ``StageRequest`` (``request.py``) and call
``run_stage`` (``dispatch.py``), which picks one of the ways a stage runs:

- ``local.py``: on this machine, with processes of its own (the SFT trainer; RL's engines, router,
  orchestrator and learner);
- ``pool.py``: RL on this machine with the engines of a running pool (``skyrl engines up``);
- ``nodes.py``: this node's share of a run across nodes (the recipe's ``[cluster]`` section);
- ``slurm.py``: an sbatch script that runs the same command on every node (``--slurm``).

``job.py`` runs a one-job plan (the SFT trainer, the quantizer), ``results.py`` turns a finished
stage's outputs into ``final/`` and its closing line, ``output.py`` holds the output modes.
Modules here import recipe, plan, launch, engines and metrics, never commands or app, and nothing
heavy at module level (``skyrl --help`` imports the commands, which import this layer).
"""
