"""`pagedllm router` flags: bad values stop the command with the reason; the router's modules
never import torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedllm.cli import build_parser
from pagedllm.router.args import router_args
from pagedllm.router.policy import Policy


def parse(*argv: str):
    parser = build_parser()
    return router_args(parser.parse_args(["router", *argv]), parser)


def test_flags_are_read(demo_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_API_KEY", "from-env\n")
    args = parse(
        "--model",
        demo_dir,
        "--backends",
        "http://10.0.0.5:8000/, http://10.0.0.6:8000,http://10.0.0.5:8000",
        "--policy",
        "round-robin",
        "--load-bound",
        "1.5",
        "--max-held-requests",
        "4",
        "--hold-timeout",
        "9",
    )
    assert args.backends == ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    assert args.routing.policy == Policy.ROUND_ROBIN
    assert args.routing.load_bound == 1.5
    assert (args.routing.max_held_requests, args.routing.hold_timeout) == (4, 9.0)
    assert args.api_key == "from-env"
    assert args.model_names == [demo_dir]
    assert args.model.max_model_len > 0 and args.model.vocab_size > 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--backends", "10.0.0.5:8000"], "expected a URL"),
        (["--backends", "http://a:8000/v1"], "no path"),
        (["--backends", "http://a:99999"], "invalid port"),
        (["--backends", ","], "at least one"),
        (["--backends", "http://a:1", "--load-bound", "0.5"], "at least 1"),
        (["--backends", "http://a:1", "--load-bound", "inf"], "finite"),
        (["--backends", "http://a:1", "--max-held-requests", "-1"], ">= 0"),
        (["--backends", "http://a:1", "--hold-timeout", "0"], "> 0"),
        (["--backends", "http://a:1", "--policy", "fastest"], "invalid choice"),
        (
            ["--backends", "http://a:1", "--chat-template", "/no/such/file"],
            "neither a file nor a Jinja template",
        ),
        ([], "--backends is required"),
    ],
)
def test_bad_flags_stop_with_the_reason(
    demo_dir: str, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse("--model", demo_dir, *extra)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_model_directory_without_a_config_is_refused(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse("--model", str(tmp_path), "--backends", "http://a:1")
    assert "config.json" in capsys.readouterr().err


def test_the_router_modules_never_import_torch() -> None:
    code = (
        "import sys\n"
        "import pagedllm.cli, pagedllm.router.server, pagedllm.router.app\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
