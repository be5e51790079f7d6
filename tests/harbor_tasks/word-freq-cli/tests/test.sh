#!/bin/bash
# Harbor verifier: run the CLI on a sample and compare; reward.json holds the share of cases passed.
set -u
mkdir -p /logs/verifier
passed=0
out=$(python3 /app/wordfreq.py /tests/sample.txt)
[ "$out" = "$(printf 'the 4\nfox 2\nand 1')" ] && passed=$((passed + 1))
out=$(python3 /app/wordfreq.py /tests/sample.txt -n 1)
[ "$out" = "the 4" ] && passed=$((passed + 1))
python3 /app/wordfreq.py /tests/missing.txt 2>/dev/null
[ $? -eq 2 ] && passed=$((passed + 1))
python3 -c "import json; json.dump({'reward': $passed / 3}, open('/logs/verifier/reward.json', 'w'))"
