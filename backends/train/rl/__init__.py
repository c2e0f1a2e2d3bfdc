"""RL algorithms of the learner: advantage estimators, policy/KL losses with mini-batch-global
normalisation, and off-policy correction for fully-async training. Pure tensor functions; the
learner (DeepSpeed ranks) and the orchestrator assemble them."""
