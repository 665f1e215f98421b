"""benchmarks/llamacpp_bench.py's pure parts: arguments, commands, request counts, medians and ratios (no
llama.cpp, no servers)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import llamacpp_bench as bench


def _row(fmt, system, c, r, tok_s, server_us, others=0.0, **extra):
    return {"format": fmt, "system": system, "target": f"{system}-{fmt}", "concurrency": c, "round": r,
            "output_tok_per_s": tok_s, "cpu_us_per_token": {"server": server_us, "loadgen": 10.0},
            "ttft_ms": {"p50": 5.0}, "itl_ms": {"p50": 2.0}, "errors": 0, "wrong_length": 0, "loadavg_1m": 1.0,
            "machine_busy_cores": 1.5, "others_cores": others, **extra}


def test_parse_args_defaults_and_engines(tmp_path):
    args = bench.parse_args(["--work-dir", str(tmp_path), "--engine", "float32=a/repo", "--engine", "int8=b/repo"])
    assert args.engine == [("float32", Path("a/repo")), ("int8", Path("b/repo"))]
    assert args.concurrency == (1, 16) and args.max_tokens == 64 and args.rounds == 3
    assert args.parallel == 16  # -np follows the highest concurrency unless given
    args = bench.parse_args(["--work-dir", str(tmp_path), "--engine", "int8=r", "--concurrency", "1,4,32",
                             "--parallel", "8", "--llama-arg=-fa", "--llama-arg=--mlock"])
    assert args.concurrency == (1, 4, 32) and args.parallel == 8 and args.llama_arg == ["-fa", "--mlock"]


@pytest.mark.parametrize("argv", [
    ["--engine", "bf16=r"],  # no such format
    ["--engine", "float32"],  # no repository
    ["--engine", "float32=a", "--engine", "float32=b"],  # one per format
    ["--engine", "int8=r", "--concurrency", "0,16"],
    ["--engine", "int8=r", "--concurrency", "x"],
    ["--engine", "int8=r", "--rounds", "0"],
    [],  # --engine is required
])
def test_parse_args_refuses(argv, tmp_path):
    with pytest.raises(SystemExit):
        bench.parse_args(["--work-dir", str(tmp_path), *argv])


def test_parse_args_needs_work_dir():
    with pytest.raises(SystemExit):
        bench.parse_args(["--engine", "int8=r"])


def test_parse_args_tables_from_needs_nothing_else(tmp_path):
    args = bench.parse_args(["--tables-from", str(tmp_path / "results.json"), "--quiet-cores", "0.5"])
    assert args.tables_from == tmp_path / "results.json" and args.quiet_cores == 0.5


def test_resolve_llama_server(tmp_path):
    built = tmp_path / "bin" / "llama-server"
    mine = tmp_path / "mine"
    mine.write_text("")
    nothing = lambda name: None  # noqa: E731
    assert bench.resolve_llama_server(None, {}, nothing, built) is None
    built.parent.mkdir()
    built.write_text("")
    assert bench.resolve_llama_server(None, {}, nothing, built) == built
    on_path = lambda name: "/usr/bin/llama-server" if name == "llama-server" else None  # noqa: E731
    assert bench.resolve_llama_server(None, {}, on_path, built) == Path("/usr/bin/llama-server")
    # LLAMA_SERVER beats PATH; the flag beats LLAMA_SERVER
    assert bench.resolve_llama_server(None, {"LLAMA_SERVER": str(mine)}, on_path, built) == mine.resolve()
    assert bench.resolve_llama_server(str(mine), {"LLAMA_SERVER": "/nope/llama-server"}, on_path, built) == \
        mine.resolve()
    with pytest.raises(FileNotFoundError, match="LLAMA_SERVER"):
        bench.resolve_llama_server(None, {"LLAMA_SERVER": str(tmp_path / "missing")}, on_path, built)
    with pytest.raises(FileNotFoundError, match="--llama-server"):
        bench.resolve_llama_server("not-on-path", {}, nothing, built)


def test_llama_server_command():
    command = bench.llama_server_command(Path("/x/llama-server"), Path("/g/m-f32.gguf"), 8123, threads=2,
                                         parallel=16, ctx_per_slot=1024, extra=["-fa"])
    assert command[0] == "/x/llama-server"
    pairs = dict(zip(command[1::2], command[2::2]))
    assert pairs["-m"] == "/g/m-f32.gguf" and pairs["--port"] == "8123" and pairs["--host"] == "127.0.0.1"
    assert command[command.index("-t") + 1] == "2" and command[command.index("-tb") + 1] == "2"
    assert command[command.index("-np") + 1] == "16" and command[command.index("-c") + 1] == "16384"
    assert "-cb" in command and "--jinja" in command and command[-1] == "-fa"


def test_convert_and_quantize_commands(tmp_path):
    command = bench.convert_command("/venv/python", Path("/l/llama.cpp"), Path("/ck/demo-small"),
                                    tmp_path / "o.gguf", "f32")
    assert command[:2] == ["/venv/python", "-c"] and command[2] == bench._CONVERT_HELPER
    assert command[3:] == ["/l/llama.cpp", "/ck/demo-small", "--outtype", "f32", "--outfile", str(tmp_path / "o.gguf")]
    compile(bench._CONVERT_HELPER, "<helper>", "exec")  # the helper is valid Python
    assert bench.quantize_command(Path("/b/llama-quantize"), Path("a.gguf"), Path("b.gguf"), "q8_0", 2) == \
        ["/b/llama-quantize", "a.gguf", "b.gguf", "Q8_0", "2"]
    assert bench.GGUF_TYPES == {"float32": "f32", "int8": "q8_0"}


def test_requests_for_whole_waves():
    assert bench.requests_for(1, 768, 64) == 12
    assert bench.requests_for(16, 768, 64) == 32  # 12 would be under one wave: two waves of 16
    assert bench.requests_for(16, 4096, 64) == 64
    assert bench.requests_for(4, 100, 64) == 8


def test_round_order_alternates():
    assert bench.round_order(0, 0) == ["ours", "llama.cpp"]
    assert bench.round_order(0, 1) == ["llama.cpp", "ours"]
    assert bench.round_order(1, 0) == ["llama.cpp", "ours"]
    assert bench.round_order(1, 1) == ["ours", "llama.cpp"]


def test_medians_and_ratios():
    rows = [
        _row("float32", "ours", 1, 0, 30.0, 900.0), _row("float32", "llama.cpp", 1, 0, 60.0, 300.0),
        _row("float32", "ours", 1, 1, 20.0, 1100.0), _row("float32", "llama.cpp", 1, 1, 40.0, 500.0),
        _row("float32", "ours", 1, 2, 25.0, 1000.0), _row("float32", "llama.cpp", 1, 2, 100.0, 400.0),
        _row("int8", "ours", 16, 0, 200.0, 100.0), _row("int8", "llama.cpp", 16, 0, 100.0, 200.0),
    ]
    summary = bench.medians(rows)
    assert [(m["format"], m["system"], m["concurrency"]) for m in summary] == [
        ("float32", "ours", 1), ("float32", "llama.cpp", 1), ("int8", "ours", 16), ("int8", "llama.cpp", 16)]
    ours = summary[0]
    assert ours["rounds"] == 3 and ours["output_tok_per_s"] == 25.0 and ours["output_tok_per_s_all"] == [30, 20, 25]
    assert ours["cpu_us_per_token"] == {"server": 1000.0, "loadgen": 10.0}
    out = bench.ratios(summary, rows)
    assert [(r["format"], r["gguf"], r["concurrency"]) for r in out] == [("float32", "f32", 1), ("int8", "q8_0", 16)]
    f32 = out[0]
    assert f32["ours_tok_per_s"] == 25.0 and f32["llama_tok_per_s"] == 60.0
    assert f32["tok_per_s_ratio"] == pytest.approx(25 / 60)  # ratio of the medians
    assert f32["tok_per_s_ratio_per_round"] == pytest.approx([0.5, 0.5, 0.25])  # each round's own pair
    assert f32["cpu_per_token_ratio"] == pytest.approx(1000 / 400)
    assert out[1]["tok_per_s_ratio"] == 2.0 and out[1]["cpu_per_token_ratio"] == 0.5
    assert f32["quiet_levels"] == (3, 3) and f32["quiet_ratio"] == pytest.approx(25 / 60)
    table = bench.ratio_table(out)
    assert "| float32 vs f32 | 1 | 25.0 | 60.0 | **0.42** | 0.50, 0.50, 0.25 |" in table
    assert "**2.00**" in bench.ratio_table(out[1:])
    assert "| ours-float32 | 1 | 3 | 25.0 | 30.0, 20.0, 25.0 |" in bench.median_table(summary)


def test_ratios_without_a_partner():
    rows = [_row("int8", "ours", 1, 0, 10.0, 1.0)]
    assert bench.ratios(bench.medians(rows), rows) == []


def test_cpu_description():
    info = bench.cpu_description("processor\t: 0\nmodel name\t: AMD EPYC 9R14\n"
                                 "flags\t\t: fpu avx2 fma avx512f avx512_vnni avx512_bf16 sse\n")
    assert info["model"] == "AMD EPYC 9R14"
    assert info["flags"] == ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"]
    assert info["cpus"] == os.cpu_count()


def test_engine_checkpoint(tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "engine_config.json").write_text(json.dumps({"checkpoint_dir": "/ck/demo-small", "weights": "int8"}))
    repo = tmp_path / "model_repository" / "tensorrt_llm"
    repo.mkdir(parents=True)
    (repo / "config.pbtxt").write_text(
        f'parameters: {{\n  key: "gpt_model_path"\n  value: {{ string_value: "{engine}" }}\n}}\n')
    checkpoint, record = bench.engine_checkpoint(tmp_path / "model_repository")
    assert checkpoint == Path("/ck/demo-small") and record["weights"] == "int8"
    (engine / "engine_config.json").unlink()
    with pytest.raises(FileNotFoundError):
        bench.engine_checkpoint(tmp_path / "model_repository")


def test_fresh_connection_target_keeps_no_connection_alive():
    import asyncio

    from benchmarks.loadgen import OpenAITarget

    async def opened():
        target = bench.fresh_connection_target("http://127.0.0.1:1/v1", "m", 64, "ours-int8")
        await target.open(16)
        try:
            pool = target._client._transport._pool
            return target, pool._max_keepalive_connections, pool._max_connections
        finally:
            await target.close()

    target, keepalive, connections = asyncio.run(opened())
    assert isinstance(target, OpenAITarget) and target.label == "ours-int8" and target.output_tokens == 64
    assert keepalive == 0 and connections == 20


def test_quiet_levels_leave_out_contended_ones():
    rows = [_row("int8", "ours", 1, 0, 30.0, 1.0, others=0.1), _row("int8", "llama.cpp", 1, 0, 60.0, 1.0, others=0.0),
            _row("int8", "ours", 1, 1, 20.0, 1.0, others=0.9), _row("int8", "llama.cpp", 1, 1, 10.0, 1.0, others=0.9),
            _row("int8", "ours", 1, 2, 25.0, 1.0, others=0.8), _row("int8", "llama.cpp", 1, 2, 12.0, 1.0, others=0.2)]
    summary = bench.medians(rows)
    assert summary[0]["quiet_levels"] == 1 and summary[0]["quiet_tok_per_s"] == 30.0
    assert summary[1]["quiet_levels"] == 2 and summary[1]["quiet_tok_per_s"] == 36.0
    assert summary[1]["output_tok_per_s"] == 12.0 and summary[1]["others_cores"] == 0.2
    ratio = bench.ratios(summary, rows)[0]
    assert ratio["tok_per_s_ratio"] == pytest.approx(25 / 12)  # all rounds: ours looks faster
    assert ratio["quiet_ratio"] == pytest.approx(30 / 36) and ratio["quiet_levels"] == (1, 2)
    assert bench.medians(rows, quiet_cores=0.05)[0]["quiet_tok_per_s"] is None
    assert bench.ratios(bench.medians(rows, quiet_cores=0.05), rows)[0]["quiet_ratio"] is None
    summary, ratio_rows, markdown = bench.tables(rows)
    assert "0.83 (1, 2)" in markdown and "| ours-int8 | 1 | 3 | 25.0 |" in markdown
