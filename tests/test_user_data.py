"""A user's own data: feature dicts with their own names, from memory, ArrayRecord files or
HuggingFace datasets, with transforms; several named eval sets.

The data: scikit-learn's bundled breast-cancer set (569 real examples, 30 features, 2 classes,
no download) as {'features': float32 [30], 'target': int32}, standardised; the last 69 examples
are the eval set (not a multiple of the eval batch, so its last batch is padded).
Tolerances as in tests/test_equivalence.py: one step agrees to reassociation (~1e-7), training
amplifies it, so per-step losses get rtol 1e-4 over 10 steps and 1e-2 over 30.
"""

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import disttrain
from disttrain import data
from disttrain.config import MeshConfig
from disttrain.data import formats
from disttrain.data.records import ID, Records
from disttrain.data.transforms import RandomShift
from disttrain.errors import DataError
from disttrain.parallel import mesh as mesh_lib
from tests.configs import user_data
from tests.helpers import devices, make_config, to_numpy

EVAL = 69


def _breast_cancer() -> tuple[dict, dict]:
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  raw = datasets.load_breast_cancer()
  x = raw.data.astype(np.float32)
  cut = len(x) - EVAL
  x = (x - x[:cut].mean(0)) / x[:cut].std(0)
  arrays = {'features': x, 'target': raw.target.astype(np.int32)}
  return ({k: v[:cut] for k, v in arrays.items()}, {k: v[cut:] for k, v in arrays.items()})


MODEL = user_data.get_model(None)  # a plain-function MLP over 'features'
TASK = disttrain.Classification(label_key='target')


def _config(n_devices: int, **overrides):
  fields = dict(mesh__data=n_devices, num_train_steps=30, log_every_steps=1, eval_every_steps=0,
                learning_rate=3e-3)
  return make_config(**{**fields, **overrides})


def _train(tmp_path, name: str, n_devices: int, train_data, eval_data, **overrides):
  result = disttrain.train(_config(n_devices, **overrides), str(tmp_path / name), model=MODEL,
                           task=TASK, devices=devices(n_devices), train_data=train_data,
                           eval_data=eval_data)
  assert result.trace_count == 1
  return result


def _losses(result) -> list[float]:
  return [r['loss'] for r in result.records if r['split'] == 'train']


@pytest.fixture(scope='module')
def cancer():
  return _breast_cancer()


@pytest.fixture(scope='module')
def reference(cancer, tmp_path_factory):
  """1-device run on the in-memory arrays."""
  train, held_out = cancer
  return _train(tmp_path_factory.mktemp('one'), 'one', 1, train, held_out)


def test_own_feature_names_on_eight_devices_match_one_and_learn(cancer, reference, tmp_path):
  train, held_out = cancer
  eight = _train(tmp_path, 'eight', 8, train, held_out)
  losses, expected = _losses(eight), _losses(reference)
  np.testing.assert_allclose(losses[:10], expected[:10], rtol=1e-4)
  np.testing.assert_allclose(losses, expected, rtol=1e-2)
  assert losses[-1] < 0.3 * losses[0], losses
  final = eight.records[-1]
  assert final['split'] == 'eval' and final['num_examples'] == EVAL
  assert final['accuracy'] > 0.9, final
  # The eval is exact over the padded batch: numpy on the final parameters gives the same.
  params = to_numpy(eight.state.params)
  logits = np.asarray(user_data.mlp_apply(params, held_out['features']))
  assert final['accuracy'] == pytest.approx(
      np.mean(np.argmax(logits, -1) == held_out['target']), abs=1e-6)


def test_array_record_files_give_the_in_memory_batches_and_losses(cancer, reference, tmp_path):
  train, held_out = cancer
  paths = formats.write_array_record(str(tmp_path / 'shards' / 'train'), train, num_shards=3)
  eval_paths = formats.write_array_record(str(tmp_path / 'shards' / 'eval'), held_out)
  assert len(paths) == 3 and all(p.endswith('.array_record') for p in paths)
  with pytest.raises(DataError, match=r'num_examples=4 but the source gave more'):  # IndexError
    formats.write_array_record(str(tmp_path / 'short' / 'x'), train, 2, num_examples=4)
  from_files = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths)).map(
      data.decode)
  eval_files = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(eval_paths)).map(
      data.decode)
  sharding = mesh_lib.batch_sharding(mesh_lib.build(MeshConfig(data=8), jax.devices()[:8]))
  memory_it = data.TrainIterator(Records(train, 'train', 0), 64, 0, sharding)
  files_it = data.TrainIterator(Records(from_files, 'train', 0), 64, 0, sharding)
  for _ in range(9):  # crosses the epoch boundary (500 // 64 = 7 batches an epoch)
    a, b = next(memory_it), next(files_it)
    assert set(a) == set(b) == {'features', 'target', ID}
    for key in ('features', 'target', ID):
      assert a[key].dtype == b[key].dtype
      np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))
  memory_it.close()
  files_it.close()
  result = _train(tmp_path, 'files', 1, from_files, eval_files)
  assert _losses(result) == _losses(reference)  # bitwise
  assert result.records[-1] == reference.records[-1]


def test_huggingface_dataset_is_a_source(cancer, reference, tmp_path):
  datasets = pytest.importorskip('datasets')
  train, held_out = cancer
  # int64 targets, as HuggingFace stores Python ints: read as JAX's int32.
  hf = lambda arrays: datasets.Dataset.from_dict(
      {'features': arrays['features'], 'target': arrays['target'].astype(np.int64)}
  ).with_format('numpy')
  result = _train(tmp_path, 'hf', 1, hf(train), hf(held_out))
  assert _losses(result) == _losses(reference)  # bitwise: the same examples, the same order


def test_several_named_eval_sets_are_each_evaluated_once(cancer, tmp_path):
  train, held_out = cancer
  halves = {'val': {k: v[:40] for k, v in held_out.items()},
            'test': {k: v[40:] for k, v in held_out.items()}}
  result = _train(tmp_path, 'named', 8, train, halves, eval_every_steps=15,
                  checkpoint_every_steps=15, best_metric='val/accuracy', max_to_keep=1)
  evals = [(r['step'], r['split'], r['num_examples']) for r in result.records
           if r['split'] != 'train']
  assert evals == [(15, 'val', 40), (15, 'test', 29), (30, 'val', 40), (30, 'test', 29)]
  info = __import__('json').loads((tmp_path / 'named' / 'run.json').read_text())
  assert info['data']['val'] == {'examples': 40} and info['data']['test'] == {'examples': 29}
  with pytest.raises(disttrain.ConfigError, match="names eval data 'dev'"):
    _train(tmp_path, 'bad', 8, train, halves, eval_every_steps=15, checkpoint_every_steps=15,
           best_metric='dev/accuracy')


class _Jitter(grain.transforms.RandomMap):
  """Adds noise drawn from the example's generator (a test of the randomness contract)."""

  def random_map(self, example, rng):
    return {**example, 'features': example['features'] + rng.normal(size=30).astype(np.float32)}


def test_random_transforms_depend_on_seed_epoch_and_example_only(cancer):
  train, _ = cancer
  source = disttrain.Data(train, [_Jitter()])

  def batches(n_devices, count=9, state=None, **kwargs):
    sharding = mesh_lib.batch_sharding(mesh_lib.build(MeshConfig(data=n_devices),
                                                  devices(n_devices)))
    it = data.TrainIterator(Records(source, 'train', 0), 64, 0, sharding, **kwargs)
    if state is not None:
      it.set_state(state)
    out = [to_numpy(next(it)) for _ in range(count)]
    state = it.get_state()
    it.close()
    return out, state
  one, _ = batches(1)
  eight, _ = batches(8)
  first, state = batches(8, count=4)
  resumed, _ = batches(8, count=5, state=state)
  for a, b, c in zip(one, eight, first + resumed):
    np.testing.assert_array_equal(a['features'], b['features'])
    np.testing.assert_array_equal(a['features'], c['features'])
  # An epoch later the same example gets other noise; without the transform, it is the data.
  by_id = {}
  for batch in one:
    for example_id, row in zip(batch[ID], batch['features']):
      by_id.setdefault(int(example_id), []).append(row - train['features'][example_id])
  repeated = [rows for rows in by_id.values() if len(rows) > 1]
  assert repeated and all(not np.allclose(rows[0], rows[1]) for rows in repeated)


def test_several_model_inputs_by_key(cancer, tmp_path):
  train, held_out = cancer
  split = lambda a: {'head': a['features'][:, :10], 'tail': a['features'][:, 10:],
                     'target': a['target']}
  two_inputs = disttrain.FunctionalModel(
      lambda rng, head, tail: user_data.mlp_init(rng, jnp.concatenate([head, tail], -1)),
      lambda params, head, tail: user_data.mlp_apply(params, jnp.concatenate([head, tail], -1)),
      input_key=('head', 'tail'))
  result = disttrain.train(_config(1, num_train_steps=3), str(tmp_path), model=two_inputs,
                           task=TASK, devices=devices(1), train_data=split(train),
                           eval_data=split(held_out))
  single = disttrain.train(_config(1, num_train_steps=3), str(tmp_path / 'one'), model=MODEL,
                           task=TASK, devices=devices(1), train_data=train, eval_data=held_out)
  assert _losses(result) == _losses(single)


def test_image_transforms_shift_within_the_padding():
  image = np.arange(16, dtype=np.float32).reshape(4, 4, 1) + 1
  shifted = RandomShift(1).random_map({'image': image}, np.random.default_rng(0))['image']
  assert shifted.shape == image.shape
  assert set(np.unique(shifted)) <= set(np.unique(image)) | {0.0}
