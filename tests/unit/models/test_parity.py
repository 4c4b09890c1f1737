"""Logits parity with transformers' PyTorch models, and HF save/load round trips."""

import jax.numpy as jnp
import numpy as np
import pytest

from dpojax.models import (
    ARCHITECTURES,
    ModelFileError,
    config_to_hf,
    from_pretrained,
    init_model,
    save_pretrained,
)
from dpojax.models.tiny import TINY_FAMILIES, tiny_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
ATTENTION = ("reference", "flash", "pallas")  # pallas runs interpreted on the CPU
# Longer than the mistral sliding window (6) and the llama3 original context (16), so both matter.
SEQ_LEN = 24


def _tokens(vocab: int, batch: int = 2, length: int = SEQ_LEN, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, length), dtype=np.int64)


def _torch_model(config_dict: dict, seed: int):
    hf_config = transformers.AutoConfig.for_model(**config_dict)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    # HF initialises norms to 1 (Gemma's to 0) and biases to 0, which would hide a missing or
    # misplaced weight; a router initialised near 0 would leave the top-k choice to ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight") and p.shape[0] < 64:
                p.copy_(0.5 * torch.randn_like(p))
    return model.eval()


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.float().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_transformers_checkpoint_loads_with_same_logits(family, tmp_path):
    config = tiny_config(family, vocab_size=128)
    torch_model = _torch_model(config_to_hf(config), seed=1)
    torch_model.save_pretrained(tmp_path)
    model, tokenizer = from_pretrained(tmp_path, tokenizer=False)
    assert tokenizer is None
    assert model.config.num_layers == config.num_layers
    tokens = _tokens(config.vocab_size)
    ours = np.asarray(model(jnp.asarray(tokens)))
    theirs = _torch_logits(torch_model, tokens)
    assert ours.shape == theirs.shape == (2, SEQ_LEN, 128)
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)
    long = _tokens(config.vocab_size, batch=1, length=200, seed=2)  # causal attention in blocks
    theirs_long = _torch_logits(torch_model, long)
    for implementation in ATTENTION:  # every attention implementation gives the same logits
        if config.attn_softcap and implementation != "reference":  # Gemma 2: reference only
            with pytest.raises(ModelFileError, match="soft-capping"):
                from_pretrained(tmp_path, tokenizer=False, attention=implementation)
            continue
        model, _ = from_pretrained(tmp_path, tokenizer=False, attention=implementation)
        np.testing.assert_allclose(
            np.asarray(model(jnp.asarray(long))),
            theirs_long,
            atol=TOL,
            rtol=0,
            err_msg=implementation,
        )


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_dpojax_export_loads_in_transformers_with_same_logits(family, tmp_path):
    config = tiny_config(family, vocab_size=128)
    model = init_model(config, seed=3)
    save_pretrained(model, None, tmp_path)
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(torch_model).__name__ == ARCHITECTURES[config.model_type]
    tokens = _tokens(config.vocab_size, seed=5)
    np.testing.assert_allclose(
        np.asarray(model(jnp.asarray(tokens))), _torch_logits(torch_model, tokens), atol=TOL, rtol=0
    )


def test_parity_with_perturbed_weights_after_round_trip(tmp_path):
    """transformers -> dpojax -> save -> transformers: the weights survive unchanged."""
    config = tiny_config("qwen3", vocab_size=128)
    torch_model = _torch_model(config_to_hf(config), seed=7)
    torch_model.save_pretrained(tmp_path / "hf")
    model, _ = from_pretrained(tmp_path / "hf", tokenizer=False)
    save_pretrained(model, None, tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    original = dict(torch_model.state_dict())
    for name, tensor in again.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), original[name].numpy(), err_msg=name)


@pytest.mark.slow
def test_tokenizer_round_trip_and_bfloat16_export(tmp_path):
    from dpojax.models.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=0)
    model, tokenizer = from_pretrained(tmp_path / "tiny")
    save_pretrained(model, tokenizer, tmp_path / "bf16", dtype="bfloat16")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "bf16")
    text = "Board:\nX.O\n.X.\n..O\nYour move:"
    assert hf_tok(text)["input_ids"] == tokenizer(text)["input_ids"]
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert torch_model.dtype == torch.bfloat16
    bf16_model, _ = from_pretrained(tmp_path / "bf16", tokenizer=False)
    tokens = _tokens(model.config.vocab_size)
    ours = np.asarray(bf16_model(jnp.asarray(tokens)))
    theirs = _torch_logits(torch_model.float(), tokens)
    # bf16-rounded weights, float32 compute on both sides.
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)
