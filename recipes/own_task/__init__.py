"""The own_task example recipe's code (a regular package, so that `own_task.reward` is imported
from here even when another directory on the path has an `own_task` folder)."""
