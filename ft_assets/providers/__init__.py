"""What each provider's machines, SDKs and command-line tools are, for the GPU targets (``ft_assets.targets``) and the
run launcher pools (``ft_assets.control``) alike.

- ``sdk_venv``: SkyPilot's and Vast.ai's SDKs, called in a venv of their own (their pins clash with Dagster's);
- ``slurm_cli``: ``sbatch``, ``squeue``, ``scancel`` on this machine or a login node over ssh;
- ``environment``: where a ``lora_adapter`` step runs (a Slurm job or any other machine), the one object it asks;
- ``slurm_job``: a worker inside a Slurm job: its tags, why SIGTERM came, its other nodes;
- ``sky_attempt``: the command of the SkyPilot pool's managed jobs (``execute_run``, ``resume_run`` when recovered);
- ``ec2_metadata`` and ``worker_identity``: which rented machine this is (EC2, RunPod, Vast.ai, SkyPilot), for the
  idle shutdown.
"""
