"""Make tests/assets/rev0003-inside.db: a small record written by gradstore at schema revision 0003.

Run with a checkout of a gradstore whose newest revision is 0003 (commit 610cd57) first on the path, e.g.
`git archive 610cd57 | tar -x -C /tmp/g0003 && PYTHONPATH=/tmp/g0003 GRADSTORE_NATIVE=0 python
tests/assets/make_rev0003_inside.py tests/assets/rev0003-inside.db`, then `sqlite3 tests/assets/rev0003-inside.db VACUUM`.
"""

import sys
import torch
import gradstore
from gradstore.store import database

out = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
with gradstore.record("asset-0003", db=out, model=model, saved=True, checksum=True) as rec:
    for step in range(2):
        x = torch.randn(5, 4)
        loss = model(x).pow(2).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        rec.step()
    x = torch.randn(5, 4)
    x[0, 0] = float("nan")
    model(x).sum().backward()
assert database.current_revision(database.make_engine(out)) == "0003"
print("ok", out)
