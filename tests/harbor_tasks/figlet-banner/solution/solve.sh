#!/bin/bash
cat > /app/banner.py <<'PY'
import sys

import pyfiglet

print(pyfiglet.figlet_format(" ".join(sys.argv[1:]), font="standard"))
PY
python3 -c "import pyfiglet"
