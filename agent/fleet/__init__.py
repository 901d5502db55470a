"""Fleet rollouts: device facts, rollout plans, gates on what devices proved, the rollout's state kept
in retained broker documents, the operator loop that runs it, and a simulator of many devices."""
