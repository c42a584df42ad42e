"""Point the notebooks' Colab badges and install cells (and the README's badges) at a repository.

  python scripts/set_repo_url.py                 # the GitHub repository of `git remote origin`
  python scripts/set_repo_url.py OWNER/NAME      # an explicit GitHub repository
  python scripts/set_repo_url.py --check         # print the repository they point at now

The badges open `https://colab.research.google.com/github/OWNER/NAME/blob/main/notebooks/...`
and the install cells `pip install "gdp-jax @ git+https://github.com/OWNER/NAME.git"` (and any
other `https://github.com/OWNER/NAME.git`, such as notebook 04's clone of the results). The
notebooks are rewritten in place with the same JSON layout (indent 1) they are kept in.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "notebooks").glob("*.ipynb")) + [ROOT / "README.md"]
BADGE = re.compile(r"colab\.research\.google\.com/github/([\w.-]+/[\w.-]+)/blob/")
INSTALL = re.compile(r"(?<=https://github\.com/)([\w.-]+/[\w.-]+?)(?=\.git)")


def repo_from_remote() -> str:
  url = subprocess.run(
    ["git", "-C", str(ROOT), "remote", "get-url", "origin"],
    capture_output=True,
    text=True,
    check=False,
  ).stdout.strip()
  match = re.search(r"github\.com[:/]([\w.-]+/[\w.-]+?)(?:\.git)?/?$", url)
  if not match:
    raise SystemExit(
      f"the origin remote ({url or 'none'}) is not a GitHub repository: pass OWNER/NAME"
    )
  return match.group(1)


def current() -> set[str]:
  found = set()
  for path in FILES:
    text = path.read_text()
    found |= set(BADGE.findall(text)) | set(INSTALL.findall(text))
  return found


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("repo", nargs="?", help="OWNER/NAME on GitHub (default: the origin remote)")
  p.add_argument("--check", action="store_true", help="print the repository in use and exit")
  args = p.parse_args(argv)
  if args.check:
    print("\n".join(sorted(current())))
    return 0
  repo = args.repo or repo_from_remote()
  if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
    raise SystemExit(f"repo must be OWNER/NAME, got {repo!r}")
  for path in FILES:
    text = path.read_text()
    new = BADGE.sub(f"colab.research.google.com/github/{repo}/blob/", text)
    new = INSTALL.sub(repo, new)
    if new != text:
      path.write_text(new)
      print(f"{path.name}: now {repo}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
