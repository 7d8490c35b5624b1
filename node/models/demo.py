"""A small, randomly initialized Llama checkpoint with a real tokenizer, built offline.

It lets the whole serving path (tokenize, schedule, run, detokenize) run anywhere in seconds.
Its text is meaningless, but every file is a genuine Hugging Face checkpoint file and the same
bytes come out on every run.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pagedllm.cache import cache_root, cached_dir

# Bumped whenever the recipe changes, so an old cached copy is not reused.
DEMO_MODEL_DIR_NAME = "demo-model-v1"
SEED = 0
INIT_STD = 0.02
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
END_OF_TURN_TOKEN = "<|eot_id|>"
# In id order: the trainer gives special tokens the first ids.
SPECIAL_TOKENS = (
    BOS_TOKEN,
    EOS_TOKEN,
    "<|start_header_id|>",
    "<|end_header_id|>",
    END_OF_TURN_TOKEN,
)
HIDDEN_SIZE = 256
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
INTERMEDIATE_SIZE = 768
NUM_LAYERS = 4
VOCAB_SIZE = 2048
MAX_POSITION_EMBEDDINGS = 2048
RMS_NORM_EPS = 1e-5


def demo_model_dir() -> Path:
    """The demo model's directory under the cache (``$PAGEDLLM_CACHE_DIR`` or
    ``~/.cache/pagedllm``), written on first use (see ``cached_dir``)."""
    return cached_dir(cache_root() / DEMO_MODEL_DIR_NAME, write_demo_model)


def write_demo_model(directory: str | Path) -> Path:
    """Write the demo checkpoint (config, generation config, weights, tokenizer) into
    ``directory``, creating it if needed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(_data_text("demo_corpus.txt"))
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_json(directory / "tokenizer_config.json", _tokenizer_config())
    _write_json(directory / "config.json", _model_config(tokenizer))
    _write_json(directory / "generation_config.json", _generation_config(tokenizer))
    save_file(random_weights(), directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def train_tokenizer(text: str) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) that prepends ``BOS_TOKEN``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, tokenizer.token_to_id(BOS_TOKEN))],
    )
    return tokenizer


def random_weights() -> dict[str, torch.Tensor]:
    """Hugging Face Llama tensors: normal(0, INIT_STD) matrices, unit norms, one seeded stream."""
    generator = torch.Generator().manual_seed(SEED)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * INIT_STD

    weights = {"model.embed_tokens.weight": matrix(VOCAB_SIZE, HIDDEN_SIZE)}
    for layer in range(NUM_LAYERS):
        prefix = f"model.layers.{layer}"
        weights |= {
            f"{prefix}.input_layernorm.weight": torch.ones(HIDDEN_SIZE),
            f"{prefix}.self_attn.q_proj.weight": matrix(NUM_HEADS * HEAD_DIM, HIDDEN_SIZE),
            f"{prefix}.self_attn.k_proj.weight": matrix(NUM_KV_HEADS * HEAD_DIM, HIDDEN_SIZE),
            f"{prefix}.self_attn.v_proj.weight": matrix(NUM_KV_HEADS * HEAD_DIM, HIDDEN_SIZE),
            f"{prefix}.self_attn.o_proj.weight": matrix(HIDDEN_SIZE, NUM_HEADS * HEAD_DIM),
            f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN_SIZE),
            f"{prefix}.mlp.gate_proj.weight": matrix(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            f"{prefix}.mlp.up_proj.weight": matrix(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            f"{prefix}.mlp.down_proj.weight": matrix(HIDDEN_SIZE, INTERMEDIATE_SIZE),
        }
    weights["model.norm.weight"] = torch.ones(HIDDEN_SIZE)
    return weights


def _model_config(tokenizer: Tokenizer) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": INIT_STD,
        "bos_token_id": tokenizer.token_to_id(BOS_TOKEN),
        "eos_token_id": tokenizer.token_to_id(EOS_TOKEN),
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _generation_config(tokenizer: Tokenizer) -> dict[str, Any]:
    # A chat reply ends with END_OF_TURN_TOKEN, plain text with EOS_TOKEN: both stop generation.
    return {
        "bos_token_id": tokenizer.token_to_id(BOS_TOKEN),
        "eos_token_id": [
            tokenizer.token_to_id(EOS_TOKEN),
            tokenizer.token_to_id(END_OF_TURN_TOKEN),
        ],
    }


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "clean_up_tokenization_spaces": False,
        "chat_template": _data_text("demo_chat_template.jinja"),
    }


def _data_text(name: str) -> str:
    return (resources.files("pagedllm.models") / "data" / name).read_text(encoding="utf-8")


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")
