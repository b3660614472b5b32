import sys
from pathlib import Path

# The repo is a set of flat scripts; make them importable from the tests without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
