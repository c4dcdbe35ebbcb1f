// What the two parts of dsec._dsec share: _dsec.cpp (the blocking API) and _dsec_aio.cpp (the asyncio core).
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "dsec/client.hpp"
#include "dsec/error.hpp"

// The dsec.errors exception object for `e` (dsec.NotFound, dsec.OutcomeUnknown with its request id, ...), not raised.
pybind11::object dsec_exception(const dsec::Error& e);

// The dsec::Client behind a _dsec.Client; FailedPrecondition once it is closed.
std::shared_ptr<dsec::Client> client_of(pybind11::handle py_client);

// Adds _dsec.AsyncCore (the asyncio core, one I/O thread per client) to the module.
void bind_aio(pybind11::module_& m);
