#pragma once
//! lockstep with MPI processes: everything of <lockstep/lockstep.hpp> plus the MPI part
//! (target lockstep::mpi): MpiComm, run(Mpi) and MpiStore; run(Auto) then also picks MPI
//! processes under mpirun.

#include "lockstep/lockstep.hpp"
#include "lockstep/mpi/mpi_comm.hpp"
#include "lockstep/mpi/run_mpi.hpp"
#include "lockstep/mpi/mpi_store.hpp"
