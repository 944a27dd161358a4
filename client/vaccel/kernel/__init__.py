"""The vaccel Jupyter kernel: a Python kernel that holds its devices only while it lives.

    vaccel kernel install --user --gpus 1     # "Python 3 (vaccel, 1 GPU)" in the launcher

- __main__.py    the kernel process: lease first, then IPython's kernel in the same process
- provisioner.py the Jupyter server's side: relays the queue place, fails a refused start,
                 keeps an ended lease ended across Jupyter's automatic restart
- stopped.py     the kernel that automatic restart gets: no lease, every cell says why
- report.py      what the kernel tells the provisioner (queue, grant, refusal, end), a line each
- magic.py       `%vaccel` in a notebook cell: the kernel's lease
- install.py     `vaccel kernel install`: the kernelspec
- cli.py         registers `vaccel kernel` with the CLI (imports nothing of Jupyter)

Importing this package imports nothing: the CLI lists it at every start.

The top layer with vaccel/entry.py: may import the library (vaccel.leasing, vaccel.current),
the CLI's shared parts (vaccel.cli.common) and everything below them.
"""
