"""Downstream evaluations of a language model during training (data.eval_tasks).

  tasks       data.eval_tasks' NAME=PATH pairs; multiple-choice and generation JSON lines files
  scoring     batched log-likelihoods and greedy continuations on the training mesh
  metrics     lm-evaluation-harness's acc, acc_norm and exact_match; GSM8K answer extraction
  downstream  a run's tasks tokenized once and scored at each eval (training/actions.py)
  harness     lm-evaluation-harness's model backend on the scorer; `disttrain lm-eval`
  harness_tasks  lm-eval's tasks by name before a model loads (groups, tags, generation lengths)
"""

from disttrain import moved

_EXPORTS = {'Downstream': 'downstream', 'gsm8k_answer': 'metrics'}
__all__ = sorted(_EXPORTS)
__getattr__ = moved.names(__name__, _EXPORTS)
