# Sourced by the scripts: the environment tpx runs under mpirun with on a small machine.
# One BLAS thread per rank (ranks are the parallelism); Open MPI needs explicit consent to run as
# root (containers, CI) and to place more ranks than cores.
export OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
# One node: the ob1 messaging layer over shared memory starts in a tenth of UCX's time (0.35 s per
# process here), and a job whose ranks have already exited with an error ends at once instead of
# after mpirun's two one-second waits before SIGTERM and SIGKILL. A caller's own choice stays.
export OMPI_MCA_pml=${OMPI_MCA_pml:-ob1} OMPI_MCA_odls_base_sigkill_timeout=${OMPI_MCA_odls_base_sigkill_timeout:-0}
TPX_MPIRUN=(mpirun --oversubscribe --bind-to none)
