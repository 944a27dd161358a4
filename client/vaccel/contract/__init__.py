"""The runtime contract, client side: the contract files a job brings (runtime-spec.yaml,
accelerator.yaml), the facts of the job's environment the broker checks them against (the
torch build, its architectures, installed packages), and the check report's text.

May import: vaccel.accelerator (introspection only; never a device runtime) and vaccel_common.
"""
