"""A checkpoint's generic tokenizer loads without its model config: an installed transformers that does not know
the architecture, or knows it in another form (5.17 refuses glm5_next's layer_types on the H200), must not block it.
The config here is one 5.25 refuses the same way."""
import json

from engine.model_source import load_tokenizer
from tests.fixtures.tiny_models import make_tokenizer


def test_a_generic_tokenizer_loads_whatever_the_model_config_says(tmp_path):
    made = make_tokenizer(tmp_path, 384, glm=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm5_next", "text_config": {"layer_types": ["kiln_unknown_attention"], "num_hidden_layers": 1}}))
    tok = load_tokenizer(_dir(tmp_path))
    assert tok("hello world")["input_ids"] == made("hello world")["input_ids"]
    assert tok.eos_token_id == made.eos_token_id and tok.chat_template == made.chat_template


def _dir(path):
    class Folder:               # load_tokenizer reads only .dir of a checkpoint that is not a GGUF
        dir = path
    return Folder()
