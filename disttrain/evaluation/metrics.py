"""Downstream metrics as lm-evaluation-harness computes them, and GSM8K's answer extraction.

  accuracy       argmax over the choices of the summed log-likelihood == answer   (lm-eval acc)
  accuracy_norm  argmax of the log-likelihood / the choice's length in characters == answer
                 (acc_norm: lm-eval divides by len(choice), the string as the task gives it)
  exact_match    extract(generation) == extract(answer)            (exact_match after a filter)
Ties go to the first choice, as numpy's argmax (which lm-eval calls) gives them. The default
extraction is GSM8K's: the number after the first '####' when there is one (lm-eval's
strict-match, which also holds when a generation runs on into a question of its own), else the
last number in the text (its flexible-extract), commas and whitespace stripped; a
config file's get_eval_extract(config) may return its own text -> str function instead.
"""

import re
from collections.abc import Sequence
from typing import Callable

import numpy as np

from disttrain.errors import DataError
from disttrain.evaluation.tasks import Prompt, Question

Extract = Callable[[str], str]
_NUMBER = re.compile(r'-?[0-9][0-9,]*(?:\.[0-9]+)?')


def gsm8k_answer(text: str) -> str:
  """The answer GSM8K's references and generations are compared by (module doc)."""
  after = text.partition('####')[2] if '####' in text else None
  if after is not None:
    found = _NUMBER.search(after)
    return _clean(found.group() if found else after)
  numbers = _NUMBER.findall(text)
  return _clean(numbers[-1]) if numbers else text.strip()


def _clean(answer: str) -> str:
  return re.sub(r'[,\s]', '', answer)


def choice_scores(loglikelihoods: Sequence[float], question: Question) -> tuple[bool, bool]:
  """(acc, acc_norm) of one question from its choices' summed log-likelihoods."""
  lls = np.asarray(loglikelihoods, np.float64)
  # lm-eval divides by the choice's characters without its target delimiter, ' ': the leading
  # space our format writes into the choice is that delimiter.
  lengths = np.asarray([float(len(choice) - choice.startswith(' ')) or 1.0
                        for choice in question.choices])
  return (int(np.argmax(lls)) == question.answer,
          int(np.argmax(lls / lengths)) == question.answer)


def multiple_choice(loglikelihoods: Sequence[Sequence[float]],
                    questions: Sequence[Question]) -> dict:
  """{'accuracy', 'accuracy_norm', 'num_examples'} over the questions, lm-eval's acc and
  acc_norm."""
  scores = np.asarray([choice_scores(lls, q) for lls, q in zip(loglikelihoods, questions)],
                      np.float64).reshape(-1, 2)
  return {'accuracy': float(scores[:, 0].mean()), 'accuracy_norm': float(scores[:, 1].mean()),
          'num_examples': len(questions)}


def matches(generation: str, prompt: Prompt, extract: Extract) -> bool:
  """Whether the extracted generation equals the extracted reference answer."""
  got, want = extract(generation), extract(prompt.answer)
  for value in (got, want):
    if not isinstance(value, str):
      raise DataError(f'the eval extraction {getattr(extract, "__name__", extract)!r} returned '
                      f'{value!r} ({type(value).__name__}); return the answer as a string')
  return got == want


def generation(generations: Sequence[str], prompts: Sequence[Prompt],
               extract: Extract = gsm8k_answer) -> dict:
  """{'exact_match', 'num_examples'} over the prompts' greedy generations."""
  hits = [matches(text, prompt, extract) for text, prompt in zip(generations, prompts)]
  return {'exact_match': float(np.mean(hits)), 'num_examples': len(prompts)}
