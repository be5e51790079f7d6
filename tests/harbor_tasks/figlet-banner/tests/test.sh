#!/bin/bash
mkdir -p /logs/verifier
expected=$(python3 -c "import pyfiglet; print(pyfiglet.figlet_format('hi', font='standard'))")
got=$(python3 /app/banner.py hi)
if [ -n "$expected" ] && [ "$got" = "$expected" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
