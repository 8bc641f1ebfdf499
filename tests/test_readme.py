"""README.md tells the truth: its CLI reference is the commands' own --help, and it starts with
the two set-up commands."""
import subprocess
import sys


def test_cli_reference_is_current(repo_root):
    r = subprocess.run([sys.executable, "scripts/cli_reference.py", "--check"], cwd=repo_root,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_readme_starts_with_the_two_commands(repo_root):
    text = (repo_root / "README.md").read_text()
    first_block = text.split("```", 2)[1]
    assert "make demo" in first_block and "make test" in first_block
