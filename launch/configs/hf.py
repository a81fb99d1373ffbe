"""Fine-tune a Hugging Face model from its directory: the model is whatever its config.json says.

  python launch/train.py --config=launch/configs/hf.py --workdir=runs/ft \\
      --config.restore_from=PATH/TO/Qwen3-0.6B --config.data.train_files=chat.jsonl ...

model.name='hf' takes the family (disttrain/hf/families.py: Llama, Qwen, Mistral, Mixtral,
Gemma, GPT-2) and every model field from restore_from's config.json, as `from_pretrained` does;
a model field set on the command line must agree with it (one line naming both values
otherwise). The directory's tokenizer is the data's when data.tokenizer is unset. The rest is a
fine-tuning recipe: prompt/completion or chat JSON lines (data.name='sft', loss on completions),
AdamW at 1e-5 with a short warm-up and cosine decay, no dropout, bfloat16 compute, the Llama
logical rules (width over fsdp; heads, MLP and vocabulary over tensor). run.json records the
model it resolved to.
"""

from disttrain import config as config_lib


def get_config():
  cfg = config_lib.defaults()
  cfg.model.name = 'hf'
  cfg.model.dropout = 0.0
  # Mixture-of-experts directories train as transformers does: dropless, router losses only
  # where config.json has output_router_logits; a value set here or on the command line wins.
  cfg.model.expert_capacity = -1.0
  cfg.model.router_aux_weight = -1.0
  cfg.model.router_z_weight = -1.0
  cfg.model.router_balance = ''  # transformers' form of the balancing loss
  cfg.data.name = 'sft'
  cfg.data.seq_len = 2048
  cfg.global_batch_size = 16
  cfg.eval_batch_size = 16
  cfg.precision.compute_dtype = 'bfloat16'
  cfg.optimizer = 'adamw'
  cfg.learning_rate = 1e-5
  cfg.weight_decay = 0.0
  cfg.lr_schedule = 'cosine'
  cfg.warmup_steps = 20
  cfg.num_train_steps = 1000
  cfg.logical_rules = (('embed', 'fsdp'), ('heads', 'tensor'), ('kv_heads', 'tensor'),
                       ('mlp', 'tensor'), ('vocab', 'tensor'))
  cfg.log_every_steps = 10
  cfg.eval_every_steps = 200
  cfg.checkpoint_every_steps = 200
  return cfg
