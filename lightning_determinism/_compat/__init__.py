"""Every private name of Lightning, Fabric, torch, torchmetrics and the data libraries the package relies on, checked.

``pieces`` lists the names Lightning, torch and torchmetrics give, each belonging to a feature of ``features``;
``checks`` makes a feature refuse, in one line, when it is turned on without one of its pieces (importing checks
nothing) and holds the names themselves; ``access`` the accessors that read them at run time; ``checkpointing`` the
replay wrapped around activation checkpointing; ``strategy_names`` the hint added to Lightning's refusal of a mistyped
strategy name; ``data`` the names of the data libraries (litdata, Hugging Face datasets: checked where used).
A leaf: imports no other folder of the package.
"""
