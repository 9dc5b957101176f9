# python3 benches/patch_report_files.py results/offline.json target/replay-full/replay.json
"""Brings a committed offline report's artifact version and its .cma variants' file fields
up to date from a fresh replay's report, editing the text in place (everything else stays
the recorded run's, byte for byte)."""
import json, sys
rec_path, fresh_path = sys.argv[1], sys.argv[2]
text = open(rec_path).read()
rec, fresh = json.loads(text), json.load(open(fresh_path))
fv = {v["name"]: v for v in fresh["variants"]}
def sub(a, b):
    global text
    assert text.count(a) == 1, a
    text = text.replace(a, b)
for v in rec["variants"]:
    s, f = v["storage"], fv[v["name"]]["storage"]
    if s["file"].endswith(".cma") and (s["file_bytes"], s["file_sha256"]) != (f["file_bytes"], f["file_sha256"]):
        assert s["modules"] == f["modules"] and s["other_bytes"] == f["other_bytes"], v["name"]
        sub(f'"file":"{s["file"]}","file_bytes":{s["file_bytes"]},"file_sha256":"{s["file_sha256"]}"',
            f'"file":"{s["file"]}","file_bytes":{f["file_bytes"]},"file_sha256":"{f["file_sha256"]}"')
        print(v["name"], s["file_bytes"], "->", f["file_bytes"])
sub(f'"artifact_version":{rec["artifact_version"]}', f'"artifact_version":{fresh["artifact_version"]}')
open(rec_path, "w").write(text)
