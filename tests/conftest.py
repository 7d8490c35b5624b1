import sys
from pathlib import Path

# Test helpers (fake workers, tiny model builders) live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))
