"""Tools for one node or one graph, live or recorded: explain, replay and replay_check, verify (custom
Functions against finite differences), capture (custom Functions' forward inputs), and the generated docs
page. Built on gradstore.recording (the graph walk, measurements) and gradstore.store (the recorded view).

The functions are reached from the top-level package (`gradstore.explain`, `gradstore.replay`,
`gradstore.verify`); this package's modules keep their own names (`gradstore.inspect.explain`).
"""
