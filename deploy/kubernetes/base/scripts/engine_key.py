"""The engine Job's helpers (build-engine.sh): is ENGINE_KEY built already, and from what; the checkpoint
as the key serves it.

    python engine_key.py built DIR VERSION TP_SIZE SHA256 [PP_SIZE]
                                                            exit 0: DIR holds an engine built from exactly
                                                            these (TensorRT-LLM version, TP size, checkpoint
                                                            SHA-256, PP size: 1 if not given or not recorded);
                                                            10: no engine there yet; 1: one built from
                                                            something else (the message says what)
    python engine_key.py snapshot SOURCE TARGET             TARGET = the checkpoint SOURCE, its small files
                                                            (tokenizer, chat template, configs) copied, its
                                                            weight files linked

A key's engine never changes once built: the pods of a Deployment revision serve /cache/<its ENGINE_KEY>
whenever they (re)start, so the Job refuses to build anything else under a key that is built already, and
the engine, Triton's configs and the tokenizer they name (hf/, the snapshot) all live under the key. The
weights are only linked: the build reads them once; the engine then holds them.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import sys
from pathlib import Path

NOT_BUILT = 10
# Linked, not copied: what only the build reads (the weights, in any of the formats checkpoints ship).
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.h5", "*.msgpack", "*.ckpt", "*.onnx")
LINK_AT_BYTES = 100 * 1024 * 1024  # and any other file this large: tokenizers and configs are far smaller


def built(directory: Path, version: str, tp_size: str, sha256: str, pp_size: str = "1") -> int:
    record_path = directory / "engine" / "engine_config.json"  # written last by the build
    if not record_path.is_file():
        return NOT_BUILT
    record = json.loads(record_path.read_text())
    found = (record.get("tensorrt_llm_version"), str(record.get("tp_size")), record.get("checkpoint_sha256"),
             str(record.get("pp_size", 1)))
    wanted = (version, str(tp_size), sha256, str(pp_size))
    if found != wanted:
        print(f"error: engine key {directory.name} is built already, from TensorRT-LLM {found[0]}, TP size "
              f"{found[1]}, PP size {found[3]}, checkpoint SHA-256 {found[2]}; this Job would build TensorRT-LLM "
              f"{wanted[0]}, TP size {wanted[1]}, PP size {wanted[3]}, checkpoint SHA-256 {wanted[2]}. The pods "
              "serving that key must not see their engine "
              "change: set a new ENGINE_KEY (the ConfigMap tritonllm-engine, base/kustomization.yaml) and apply "
              "again, which rolls the server pods over to it once it is built", file=sys.stderr)
        return 1
    print(f"engine key {directory.name}: built already, from the same checkpoint, image, TP and PP size")
    return 0


def snapshot(source: Path, target: Path) -> None:
    """Copy the checkpoint's small files, link its weights (and symlinked folders), keeping relative paths."""
    for root, dirs, files in os.walk(source):
        into = target / Path(root).relative_to(source)
        into.mkdir(parents=True, exist_ok=True)
        for name in list(dirs):
            if (Path(root) / name).is_symlink():
                os.symlink(os.path.realpath(Path(root) / name), into / name)
                dirs.remove(name)
        for name in files:
            path = Path(root) / name
            if any(fnmatch.fnmatch(name, pattern) for pattern in WEIGHT_FILES) or path.stat().st_size >= LINK_AT_BYTES:
                os.symlink(os.path.realpath(path), into / name)
            else:
                shutil.copy2(path, into / name)


def main(argv: list[str]) -> int:
    if argv[:1] == ["built"] and len(argv) in (5, 6):
        return built(Path(argv[1]), *argv[2:])
    if argv[:1] == ["snapshot"] and len(argv) == 3:
        snapshot(Path(argv[1]), Path(argv[2]))
        return 0
    print(__doc__, file=sys.stderr)
    return 64


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
