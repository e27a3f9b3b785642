"""The main job, end to end, and the command-line entry points."""

import subprocess
import sys

from shmkv.tools import demo


def test_demo_verifies_everything_and_reuses_the_shared_prefix():
    summary = demo.run(num_prompts=6, workers=2, decode_steps=4, quiet=True)
    assert summary["sequences"] == 6
    assert (
        summary["tokens"] == sum(demo.SYSTEM_PREFIX + 16 + (i * 37) % 200 for i in range(6)) + 6 * 4
    )
    assert summary["values_verified"] == summary["tokens"] * 4 * 2 * 8 * 64
    assert summary["prefix_cached_tokens"] > 0


def test_cli_entry_points():
    for argv in (["-m", "shmkv", "--help"], ["-m", "shmkv", "demo", "--help"]):
        out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "demo" in out.stdout
