#pragma once
//! lockstep with MPI processes: everything of <lockstep/lockstep.hpp> plus the MPI part
//! (target lockstep::mpi): MpiComm, run(Mpi) and MpiStore; run(Auto) then also picks MPI
//! processes under mpirun.

#include "lockstep/lockstep.hpp"
#include "lockstep/mpi/comm.hpp"
#include "lockstep/mpi/run.hpp"
#include "lockstep/mpi/store.hpp"
