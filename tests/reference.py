"""Float64 transcriptions of the paper's formulas, written independently of equiopt.

Each function follows the paper's notation literally (explicit projector matrices,
explicit diagonal matrices, eigendecomposition for the matrix functions) so that the
library's batched implementation is checked against a second, naive derivation.
"""

import torch


def projector(m):
    return torch.eye(m, dtype=torch.float64) - torch.ones(m, m, dtype=torch.float64) / m


def inv_sqrt(A, eps):
    lam, V = torch.linalg.eigh(0.5 * (A + A.T) + eps * torch.eye(A.shape[0], dtype=A.dtype))
    return V @ torch.diag(lam**-0.5) @ V.T


def damp(C, eps, damping, D):
    """The damping of the Gram ``C`` of ``D``: the paper's absolute ``eps``, or ``eps ||D||_F^2 / min(m, n)``."""
    return eps if damping == "absolute" else eps * torch.trace(C).item() / min(D.shape)


def row_diag(D, eps):
    return torch.diag(torch.stack([1.0 / (D[i].norm() + eps) for i in range(D.shape[0])]))


def right(D, eps, alpha, centered=False, damping="relative"):
    P = projector(D.shape[0]) if centered else torch.eye(D.shape[0], dtype=D.dtype)
    Db = P @ D
    C = Db.T @ Db
    R = inv_sqrt(C, damp(C, eps, damping, D))
    nu = max(torch.trace(C @ R).item(), eps)
    return P @ (nu**alpha * Db @ R)


def left(D, eps, alpha, centered=False, damping="relative"):
    P = projector(D.shape[0]) if centered else torch.eye(D.shape[0], dtype=D.dtype)
    Db = P @ D
    C = Db @ Db.T
    eps_c = damp(C, eps, damping, D)
    if centered:
        # (C + eps Pi)^(-1/2) on 1-perp: eigendecomposition restricted to the centred subspace
        lam, V = torch.linalg.eigh(C)
        keep = torch.ones_like(lam, dtype=torch.bool)
        ones = torch.ones(C.shape[0], dtype=C.dtype) / C.shape[0] ** 0.5
        overlap = (V.T @ ones).abs()
        keep[overlap.argmax()] = False
        Vk, lk = V[:, keep], lam[keep]
        L = Vk @ torch.diag((lk + eps_c) ** -0.5) @ Vk.T
    else:
        L = inv_sqrt(C, eps_c)
    nu = max(torch.trace(C @ L).item(), eps)
    return P @ (nu**alpha * L @ Db)


def row(D, eps, centered=False):
    P = projector(D.shape[0]) if centered else torch.eye(D.shape[0], dtype=D.dtype)
    Db = P @ D
    return P @ row_diag(Db, eps) @ Db


def hybrid(D, order, eps, alpha, centered=False, damping="relative"):
    """Algorithm 2, line by line."""
    m = D.shape[0]
    P = projector(m) if centered else torch.eye(m, dtype=D.dtype)
    M = P @ D
    if order == "row_then_right":
        Z = P @ row_diag(M, eps) @ M
        C = Z.T @ Z
        R = inv_sqrt(C, damp(C, eps, damping, D))
        nu = max(torch.trace(C @ R).item(), eps)
        return P @ (nu**alpha * Z @ R)
    if order == "right_then_row":
        C = M.T @ M
        R = inv_sqrt(C, damp(C, eps, damping, D))
        nu = max(torch.trace(C @ R).item(), eps)
        Z = P @ (nu**alpha * M @ R)
    else:
        Z = left(D, eps, alpha, centered, damping)
    return P @ row_diag(Z, eps) @ Z


def polar(X):
    U, _, Vh = torch.linalg.svd(X, full_matrices=False)
    return U @ Vh
