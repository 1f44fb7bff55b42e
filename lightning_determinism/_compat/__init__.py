"""Every private name of Lightning, Fabric, torch, torchmetrics and the data libraries the package relies on, checked.

``checks`` holds the names Lightning, torch and torchmetrics give (checked at import), ``access`` the accessors that
read them at run time; ``data`` those of the data libraries (litdata, Hugging Face datasets: checked where used).
A leaf: imports no other folder of the package.
"""
