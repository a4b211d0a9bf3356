# lockstep_part_mode(<PART> <description> <out_var>): the cache option LOCKSTEP_ENABLE_<PART>
# (AUTO by default, ON or OFF) of an optional part, checked, upper-cased into <out_var>.
macro(lockstep_part_mode part description out_var)
  set(LOCKSTEP_ENABLE_${part} AUTO CACHE STRING "${description}: AUTO, ON or OFF")
  set_property(CACHE LOCKSTEP_ENABLE_${part} PROPERTY STRINGS AUTO ON OFF)
  string(TOUPPER "${LOCKSTEP_ENABLE_${part}}" ${out_var})
  if(NOT ${out_var} MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "LOCKSTEP_ENABLE_${part} is '${LOCKSTEP_ENABLE_${part}}'; use AUTO, ON or OFF.")
  endif()
endmacro()
