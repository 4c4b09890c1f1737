"""load_tokenizer picks the class AutoTokenizer picks, and skips torch where that class is known."""

import json
import subprocess
import sys

import pytest
import transformers

from dpojax.models.hf import direct_tokenizer_class, load_tokenizer
from dpojax.models.tiny import make_tiny_checkpoint

TEXT = "Board:\na|2|C\n4|e|6\n7|8|9\nYou are X. Your move: 5"
MESSAGES = [
    {"role": "system", "content": "Play well."},
    {"role": "user", "content": "a|2|C 4|e|6 7|8|9"},
]


def _edit_json(path, **fields):
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


def _assert_same_tokenizer(a, b):
    assert type(a) is type(b)
    assert a(TEXT)["input_ids"] == b(TEXT)["input_ids"]
    assert a.convert_ids_to_tokens(a(TEXT)["input_ids"]) == b.convert_ids_to_tokens(
        b(TEXT)["input_ids"]
    )
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (
        b.bos_token_id,
        b.eos_token_id,
        b.pad_token_id,
    )
    if a.chat_template:
        kw = dict(tokenize=False, add_generation_prompt=True)
        assert a.apply_chat_template(MESSAGES, **kw) == b.apply_chat_template(MESSAGES, **kw)


@pytest.mark.parametrize("family", ["llama", "llama_tied", "mistral", "qwen2", "qwen3"])
def test_same_class_and_ids_as_autotokenizer(tmp_path, family):
    path = make_tiny_checkpoint(tmp_path / family, family)
    auto = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    _assert_same_tokenizer(auto, load_tokenizer(path))
    direct = direct_tokenizer_class(path)
    # The direct path covers exactly the model types whose generic hub class AutoTokenizer keeps.
    assert (direct is not None) == (family in ("llama", "llama_tied", "qwen3"))


def test_qwen2_with_generic_class_goes_through_autotokenizer(tmp_path):
    # transformers overrides a generic hub class for qwen2 with Qwen2Tokenizer: no shortcut.
    path = make_tiny_checkpoint(tmp_path / "q", "qwen2")
    _edit_json(path / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast")
    assert direct_tokenizer_class(path) is None
    auto = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert type(auto).__name__ == "Qwen2Tokenizer"
    _assert_same_tokenizer(auto, load_tokenizer(path))


def test_named_model_class_goes_through_autotokenizer(tmp_path):
    # A Llama checkpoint that names LlamaTokenizerFast but ships a ByteLevel tokenizer.json:
    # AutoTokenizer loads TokenizersBackend (LlamaTokenizer would change the ids); so must we.
    path = make_tiny_checkpoint(tmp_path / "l", "llama")
    _edit_json(path / "tokenizer_config.json", tokenizer_class="LlamaTokenizerFast")
    assert direct_tokenizer_class(path) is None
    auto = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    named = transformers.LlamaTokenizerFast.from_pretrained(str(path), local_files_only=True)
    assert named(TEXT)["input_ids"] != auto(TEXT)["input_ids"]  # the trap is real
    _assert_same_tokenizer(auto, load_tokenizer(path))


def test_auto_map_and_missing_files_go_through_autotokenizer(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "l", "llama")
    assert direct_tokenizer_class(path) is transformers.TokenizersBackend
    _edit_json(path / "tokenizer_config.json", auto_map={"AutoTokenizer": [None, "x.Y"]})
    assert direct_tokenizer_class(path) is None
    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    (path / "config.json").unlink()
    assert direct_tokenizer_class(path) is None


@pytest.mark.slow
def test_loading_a_tiny_checkpoint_does_not_import_torch(tmp_path):
    pytest.importorskip("torch")  # with torch absent the check would say nothing
    path = make_tiny_checkpoint(tmp_path / "l", "llama")
    code = (
        "import sys\n"
        "from dpojax.models import from_pretrained\n"
        f"model, tok = from_pretrained({str(path)!r})\n"
        "assert tok('a|2|C')['input_ids']\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]


def test_a_tokenizer_that_cannot_load_names_its_folder_and_the_fix(tmp_path):
    """Before: the library's multi-line error, naming no path (exit 3 on the command line)."""
    from dpojax.models import ModelFileError

    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    (path / "tokenizer.json").unlink()
    with pytest.raises(ModelFileError) as info:
        load_tokenizer(path)
    message = str(info.value)
    assert message.startswith(f"{path}: cannot load the tokenizer") and "\n" not in message
    assert "has tokenizer_config.json but not tokenizer.json" in message


def test_a_folder_without_tokenizer_config_keeps_its_eos(tmp_path):
    """Before: without tokenizer_config.json the tokenizer had no EOS token, and every completion
    was trained without its EOS, silently."""
    from dpojax.data.pairs import PreferencePair
    from dpojax.data.tokenize import tokenize_pairs
    from dpojax.models import ModelFileError
    from dpojax.models.tiny import EOS

    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    eos_id = load_tokenizer(path).eos_token_id
    (path / "tokenizer_config.json").unlink()
    tokenizer = load_tokenizer(path)
    assert tokenizer.eos_token == EOS and tokenizer.eos_token_id == eos_id
    pair = tokenize_pairs([PreferencePair("q?", " yes", " no")], tokenizer, max_length=32).pairs[0]
    assert pair.chosen_ids[-1] == eos_id and pair.rejected_ids[-1] == eos_id

    config = json.loads((path / "config.json").read_text())
    config.pop("eos_token_id")
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").unlink(missing_ok=True)
    with pytest.raises(ModelFileError, match="no EOS token.*tokenizer_config.json"):
        load_tokenizer(path)


def test_an_eos_id_outside_the_vocabulary_is_refused_at_load(tmp_path):
    """Before: an EOS token added past the embedding rows loaded fine; training then hit NaN and
    exited 4 blaming the learning rate."""
    from dpojax.models.hf import from_pretrained
    from dpojax.models.safetensors_io import ModelFileError

    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    tokenizer = load_tokenizer(path)
    tokenizer.add_special_tokens({"eos_token": "<|my_eos|>"})
    tokenizer.save_pretrained(str(path))
    assert load_tokenizer(path).eos_token_id == 512
    with pytest.raises(ModelFileError) as info:
        from_pretrained(path)
    text = str(info.value)
    assert "EOS token '<|my_eos|>' has id 512" in text and "vocabulary of 512" in text
    assert str(path) in text and "tokenizer" in text
