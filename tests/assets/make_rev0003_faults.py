"""How rev0003-faults.db was made (run once with gradstore at schema revision 0003, commit 610cd57):

    PYTHONPATH=<a checkout of 610cd57> python tests/assets/make_rev0003_faults.py tests/assets/rev0003-faults.db

Two runs: "done" (3 steps, ended by its scope: status finished) and "killed" (2 steps written, then the process
was killed with SIGKILL inside its scope: status running forever, as every gradstore before revision
0007_faults left it). The file is then checkpointed (no -wal beside it).
"""

import os
import sqlite3
import subprocess
import sys

CHILD = """
import os, signal, sys, torch, gradstore
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
x = torch.randn(5, 3)
run = sys.argv[2]
with gradstore.record(run, db=sys.argv[1], model=model) as rec:
    for i in range(3 if run == "done" else 2):
        model(x).pow(2).mean().backward()
        model.zero_grad()
        if i + 1 < (3 if run == "done" else 2):
            rec.step()
    if run == "killed":
        rec.step()  # the second step is queued ...
        rec.flush()  # ... and written; the scope never ends:
        os.kill(os.getpid(), signal.SIGKILL)
"""

if __name__ == "__main__":
    out = sys.argv[1]
    for run in ("done", "killed"):
        subprocess.run([sys.executable, "-c", CHILD, out, run], env=dict(os.environ, GRADSTORE_NATIVE="0"))
    con = sqlite3.connect(out)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    print(con.execute("SELECT version_num FROM alembic_version").fetchall())
    print(con.execute("SELECT name, status FROM runs").fetchall())
    print(con.execute("SELECT r.name, st.step, st.status FROM steps st JOIN runs r ON r.id = st.run_id").fetchall())
    con.close()
