"""Per-example transforms for images, written as grain transformations (examples for your own).

A deterministic transform subclasses `grain.transforms.Map` and defines `map(example)`; a random
one subclasses `grain.transforms.RandomMap` and defines `random_map(example, rng)`, drawing only
from `rng` (a numpy Generator seeded with (seed, epoch, example index) by disttrain, so the
draws do not depend on the layout, the worker count or a resume). Examples are dicts of numpy
arrays; return a new dict. With data.workers > 0 the transforms run in worker processes, so
define them at the top level of an importable module (not inside a function or a config file
run as a script), so that they can be pickled.
"""

import dataclasses

import grain
import numpy as np


@dataclasses.dataclass(frozen=True)
class Scale(grain.transforms.Map):
  """uint8 pixels -> float32 in [0, 1] (field `key`)."""
  key: str = 'image'

  def map(self, example: dict) -> dict:
    return {**example, self.key: example[self.key].astype(np.float32) * np.float32(1 / 255)}


@dataclasses.dataclass(frozen=True)
class RandomShift(grain.transforms.RandomMap):
  """Shifts an [H, W, C] image by up to `pad` pixels each way (pad with zeros, random crop)."""
  pad: int = 2
  key: str = 'image'

  def random_map(self, example: dict, rng: np.random.Generator) -> dict:
    image = example[self.key]
    h, w = image.shape[:2]
    padded = np.pad(image, ((self.pad, self.pad), (self.pad, self.pad)) + ((0, 0),) *
                    (image.ndim - 2))
    top, left = rng.integers(0, 2 * self.pad + 1, size=2)
    return {**example, self.key: padded[top:top + h, left:left + w]}


@dataclasses.dataclass(frozen=True)
class RandomFlip(grain.transforms.RandomMap):
  """Mirrors an [H, W, C] image left-right with probability 1/2 (not for digits or text)."""
  key: str = 'image'

  def random_map(self, example: dict, rng: np.random.Generator) -> dict:
    if rng.random() < 0.5:
      return {**example, self.key: example[self.key][:, ::-1]}
    return example


@dataclasses.dataclass(frozen=True)
class RandomErase(grain.transforms.RandomMap):
  """Zeroes a random `size` x `size` square of an [H, W, C] image (cutout)."""
  size: int = 6
  key: str = 'image'

  def random_map(self, example: dict, rng: np.random.Generator) -> dict:
    image = example[self.key].copy()
    h, w = image.shape[:2]
    top, left = rng.integers(0, h - self.size + 1), rng.integers(0, w - self.size + 1)
    image[top:top + self.size, left:left + self.size] = 0
    return {**example, self.key: image}
