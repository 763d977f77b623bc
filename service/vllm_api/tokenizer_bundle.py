"""The tokenizer files a gateway needs to tokenize and render chats as kvserve does
(GetTokenizer): the loaded tokenizer saved in Hugging Face's layout (``tokenizer.json``,
``tokenizer_config.json`` with the chat template in it, ``special_tokens_map.json``, and the
template as ``chat_template.jinja`` too), zipped, with the archive's SHA-256.

For the bundled GGUF model the files are made from the GGUF itself (the tokenizer transformers
builds from it, engine/tokenizer/load.py), so the gateway tokenizes exactly as the server does.
The archive is built once, off the event loop, and cut into ``CHUNK_BYTES`` pieces.
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
import zipfile
from pathlib import Path

CHUNK_BYTES = 1 << 20  # well under gRPC's 4 MiB default message limit
# the model's generation_config.json travels too when the model directory has one
EXTRA_FILES = ("generation_config.json",)


def build_bundle(tokenizer, model_dir: str | None = None) -> tuple[bytes, str]:
    """(zip bytes, hex SHA-256) of ``tokenizer``'s files."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        tokenizer.save_pretrained(out)
        template = getattr(tokenizer, "chat_template", None)
        if template:
            _put_template(out, template)
        if model_dir is not None:
            for name in EXTRA_FILES:
                src = Path(model_dir) / name
                if src.is_file():
                    (out / name).write_bytes(src.read_bytes())
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            for path in sorted(out.iterdir()):
                if path.is_file():
                    z.write(path, path.name)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def _put_template(out: Path, template: str) -> None:
    """The chat template both inside tokenizer_config.json and as chat_template.jinja: readers
    differ in where they look."""
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "chat_template.jinja").write_text(template)


def chunks(data: bytes) -> list[bytes]:
    return [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
