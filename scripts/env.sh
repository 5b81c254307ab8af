# Sourced by the scripts: the environment tpx runs under mpirun with on a small machine.
# One BLAS thread per rank (ranks are the parallelism); Open MPI needs explicit consent to run as
# root (containers, CI) and to place more ranks than cores.
export OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
TPX_MPIRUN=(mpirun --oversubscribe --bind-to none)
